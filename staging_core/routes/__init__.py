"""Routes: how a bundle is unpacked at a destination or packed at a source, and the tar-tools route."""
