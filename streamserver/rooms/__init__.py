"""Rooms of a class, who is in them, and the signed tokens that open them."""
