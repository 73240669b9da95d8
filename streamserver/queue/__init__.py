"""Utterance jobs between gateways and ASR workers, through one Redis Stream.

gateway: Utterance -> XADD asr:jobs          (jobs.py encodes it, audio as PCM16)
worker:  XREADGROUP asr -> batch -> engine -> publish + XACK, atomically and once per utterance
A worker that dies leaves its jobs pending; another claims them (redis_queue.py).
"""
