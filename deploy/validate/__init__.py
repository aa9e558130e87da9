"""Offline checks for pagellm's deployment manifests, as a cluster's API server and KServe's
webhooks would make them, plus what only pagellm knows (the flags `pagellm serve` accepts).

`python3 -m deploy.validate FILE...` (or `-` for stdin, e.g. piped from `helm template`)
checks every YAML document and exits 1 with one line per problem.
"""
