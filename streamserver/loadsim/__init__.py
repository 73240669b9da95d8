"""Simulated classes: students that speak real clips over WebRTC, dashboards that listen."""
