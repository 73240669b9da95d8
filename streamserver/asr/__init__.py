"""The shared speech-recognition worker: utterances of every student in, transcripts out."""
