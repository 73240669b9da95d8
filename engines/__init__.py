"""Speech recognition engines: packaged Whisper weights -> ONNX graphs -> batched decoding.

Data path: audio.py (file -> 16 kHz PCM) -> features.py (log-mel) -> policy.py (encoder length)
-> backends/ (encoder + decoder steps) -> decoding.py (Whisper's rules) -> engine.py (batches
in, transcripts out).
"""
