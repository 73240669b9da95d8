"""Speech recognition engines: packaged Whisper weights -> ONNX graphs -> batched decoding.

Data path: audio.py (file or stream -> 16 kHz PCM) -> features.py (log-mel) -> policy.py (encoder
length) -> backends/ (encoder + decoder steps; tensorrt/ for TensorRT) -> decoding.py (Whisper's
rules) -> engine.py (batches in, transcripts out); gpu/ is a whole engine on a CUDA GPU, and
loading.py picks and builds one.
"""
