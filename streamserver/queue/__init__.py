"""The seam between the audio pipeline and recognition: utterances wait here for a worker.

audio pipeline -> UtteranceSink (sink.py: submit, announce, "busy") -> an UtteranceQueue
  memory_queue.MemoryQueue  in-process (`serve`): the ASR worker runs in the same process
  redis_queue.RedisQueue    a Redis Stream (`gateway` + `worker` processes), jobs.py encodes them
-> asr.worker.AsrWorker (read, recognise, complete: publish the result once and acknowledge).
Both queues keep the same promises: a result is published at most once per utterance, a job
whose worker fails is delivered again, and a job is never acknowledged without its result.
"""
