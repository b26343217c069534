"""Stores reached over HTTP(S): store URLs, and the one HTTP client the cache uses (no CUDA needed).

The client is urllib3's, imported the first time a store URL is used: a plain local
cache, or one over NFS, never imports it. :mod:`.urls` says how a store is named
(and how URLs survive ``CUDA_PROGRAM_CAS_SHARED``'s ``os.pathsep`` split);
:mod:`.client` how a request is made, authenticated, bounded in time and failed.
"""

__all__: list[str] = []
