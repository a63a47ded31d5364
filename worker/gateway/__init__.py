"""The metering model proxy: wire formats, per-lease grants, Redis metering and the HTTP server."""
