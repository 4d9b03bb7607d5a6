# vLLM's official image with the connector: the wheel .ci/setup.sh builds, added to
# vllm/vllm-openai. From the repository root:
#   bash .ci/setup.sh            # or: python3 -m pip wheel --no-deps -w dist .
#   docker build -f docker/vllm.Dockerfile -t your-registry/vllm-openai-ec:v0.32.0 .
# The tag is the vLLM release the connector is tested with end to end (docs/vllm.md).
# The image's torch is kept: the wheel is installed without the [torch] extra (the image
# already has torch and numpy), so pip never replaces vLLM's CUDA build.
FROM vllm/vllm-openai:v0.32.0

COPY dist/lmcache_ec_broker-0.1.0-cp310-abi3-linux_x86_64.whl /tmp/
# uv is the installer the vLLM image ships and documents for adding packages.
RUN uv pip install --system --no-cache /tmp/lmcache_ec_broker-0.1.0-cp310-abi3-linux_x86_64.whl \
    && rm /tmp/lmcache_ec_broker-0.1.0-cp310-abi3-linux_x86_64.whl

# The entry point stays vLLM's (vllm serve); the connector registers itself through the
# vllm.general_plugins entry point, so --ec-transfer-config '{"ec_connector":
# "ECBrokerConnector", ...}' works with no module path.
