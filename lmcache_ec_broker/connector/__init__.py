"""Client side: BrokerClient, tensor copies, and the vLLM connector."""
