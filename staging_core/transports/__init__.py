"""Transports: one small interface (base.Transport) and implementations found by URL scheme (registry)."""
from .base import Capabilities, Direction, Endpoint, RemoteEntry, Transport, TransferResult, parse_url
from .errors import TransportError
from .registry import open_transport, schemes

__all__ = ["Capabilities", "Direction", "Endpoint", "RemoteEntry", "Transport", "TransferResult", "TransportError",
           "open_transport", "parse_url", "schemes"]
