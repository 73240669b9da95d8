"""Per-student audio pipeline: WebRTC/WebSocket audio -> 16 kHz mono PCM -> VAD-cut utterances.

``resample.To16kMono`` normalises whatever the transport delivers; ``segmenter.UtteranceSegmenter``
cuts the stream into stretches of speech, stamped with server-clock arrival times.
"""
