python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PYTHONPATH:/tmp/site
unset PYTHONDONTWRITEBYTECODE QUACK_CACHE_DIR
mkdir -p -m 700 /tmp/coda-gpu
export PYTHONPYCACHEPREFIX=/tmp/coda-gpu/pycache
export CODA_CACHE_DIR=/tmp/coda-gpu/cache
