"""The one C extension, ``prefixcache.cache._chain_hash`` (the chained block hashes, chain_hash.c).

Optional: without a C compiler the install still succeeds and the hashes are computed in Python
(``prefixcache.cache.hashing.NATIVE_CHAIN`` is then ``None``); the bytes are the same either way.
Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("prefixcache.cache._chain_hash", ["prefixcache/cache/chain_hash.c"],
                             extra_compile_args=["-O2"], optional=True)])
