"""How student audio reaches the server: WebRTC (aiortc) today."""
