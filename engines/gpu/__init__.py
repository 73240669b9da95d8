"""The GPU engine (PyTorch, CUDA): model.py (Whisper's math in fp16 and the GPU log-mel) ->
inflight.py (in-flight batching: slots, CUDA graphs, the greedy rules on the GPU) -> engine.py
(TorchCudaEngine, an Engine over both). torch is an optional extra; engines/loading.py imports
this package only when the torch-cuda backend is chosen.
"""
