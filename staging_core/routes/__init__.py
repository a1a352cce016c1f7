"""Routes: how a bundle is unpacked at a destination or packed at a source, and the tar-tools route.

Each is a Route (base.py) that declares what the operations read of it, registered in registry.py
(docs/adding-a-route.md).
"""
