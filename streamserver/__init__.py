"""streamserver: a real-time voice server for live online classrooms."""

__version__ = "0.1.0"
