"""Serving benchmarks that drive a running server over HTTP (`kestrel bench serve`)."""
