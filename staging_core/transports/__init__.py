"""Transports: one small interface (base.Transport) and implementations found by URL scheme (registry)."""
from .base import (Capabilities, Direction, EarlyConnection, Endpoint, RemoteEntry, Transport, TransferResult,
                   TransportOption, parse_url)
from .errors import TransportError
from .catalog import schemes
from .registry import all_declared_options, open_transport

__all__ = ["Capabilities", "Direction", "EarlyConnection", "Endpoint", "RemoteEntry", "Transport", "TransferResult",
           "TransportError", "TransportOption", "all_declared_options", "open_transport", "parse_url", "schemes"]
