"""The far-side client: sessions, streams, probes and installs at an ssh host."""
