"""Limits shared by bmc-serve, its router and its command line (no imports: the CLI reads them before torch)."""

DEFAULT_MAX_BODY_BYTES = 4 << 20  # request bodies above this get a 413: a 128k-token prompt as token ids is ~1 MB
