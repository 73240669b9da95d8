"""Simulated classes: students that speak real clips (over WebSocket ingest or WebRTC) with
classroom turn-taking, dashboards that listen, and the `loadsim` command that measures them."""
