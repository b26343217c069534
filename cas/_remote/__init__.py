"""Stores reached over the network (no CUDA needed); each client is imported at a store URL's first use.

:mod:`.client` is the one HTTP client (urllib3's pool, one deadline per request);
:mod:`.http` the HTTP/WebDAV engine and :mod:`.httppacks` its packs; :mod:`.redis` the Redis
engine (redis-py, bounded by :mod:`.resp`); :mod:`.s3` the S3 engine (botocore signs, the
client sends) and :mod:`.bucket` a bucket's maintenance. Each engine is a
:class:`cuda_program_cas._base.engine.Engine` served by :class:`cuda_program_cas._shared.tier.Tier`.
"""

__all__: list[str] = []
