"""Recognition: batches of queued utterances -> engine -> intent -> events -> the rooms.

batch.py: one batch's results (by language, off the event loop, a failing batch retried one
utterance at a time); worker.py: the loop around a queue (read, claim, complete, heartbeat),
the same in `serve` and in `streamserver worker`; worker_process.py: the worker's main.
"""
