# The broker image (the DaemonSet's): the wheel .ci/setup.sh builds, on Python's slim image.
# The broker needs neither torch nor a GPU. From the repository root:
#   bash .ci/setup.sh            # or: python3 -m pip wheel --no-deps -w dist .
#   docker build -f docker/broker.Dockerfile -t your-registry/lmcache-ec-broker:0.1.0 .
FROM python:3.12-slim

# Only the wheel enters the image (dist/ holds the one .ci/setup.sh built).
COPY dist/lmcache_ec_broker-0.1.0-cp310-abi3-linux_x86_64.whl /tmp/
# [metrics]: the DaemonSet passes --metrics-port (prometheus_client; without it the broker
# refuses to start); [fast]: uvloop.
RUN pip install --no-cache-dir '/tmp/lmcache_ec_broker-0.1.0-cp310-abi3-linux_x86_64.whl[metrics,fast]' \
    && rm /tmp/lmcache_ec_broker-0.1.0-cp310-abi3-linux_x86_64.whl

# The uid the vLLM pods run as too (clients trust a broker of their own uid or root).
USER 1000:1000
ENTRYPOINT ["lmcache-ec-broker"]
CMD ["start"]
