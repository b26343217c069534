"""Stores reached over the network: the one HTTP client the cache uses, and the Redis engine (no CUDA needed).

The client is urllib3's, imported the first time a store URL is used: a plain local
cache, or one over NFS, never imports it. :mod:`.client` says how a request is
made, authenticated, bounded in time and failed; how a store URL is named is
:mod:`cuda_program_cas._base.urls`. :mod:`.http` is the HTTP engine of a store
(GET and ranged GETs, HEAD, WebDAV ``PUT`` through :mod:`.dav`, ``DELETE``) and :mod:`.httppacks`
its packs, read through the engine's interfaces only; :mod:`.redis` keeps a store in a Redis database through redis-py,
imported only when a Redis URL is used; :mod:`.s3` keeps one in an S3 bucket (botocore
resolves the AWS configuration and signs, imported only when ``s3://`` is used), and
:mod:`.bucket` maintains it from the bucket's listing. Each engine is an
:class:`cuda_program_cas._base.engine.Engine`, served by the one store class
:class:`cuda_program_cas._shared.tier.Tier`.
"""

__all__: list[str] = []
