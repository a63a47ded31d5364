"""The metering model proxy: wire formats (``wire``) and the usage they report (``usage``),
per-lease grants (``grant``), Redis metering (``meter``), one metered request (``call``), the
HTTP edges (``httpio``) and the server (``server``)."""
