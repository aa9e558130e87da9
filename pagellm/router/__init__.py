"""`pagellm router`: an OpenAI-compatible gateway in front of pagellm replicas and external
providers, balancing by load and prefix, and keeping customer data on local models."""
