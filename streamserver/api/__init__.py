"""The HTTP side: rooms API, WebRTC offers, the dashboard feed, the web pages, health."""
