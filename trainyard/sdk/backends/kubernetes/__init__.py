"""The Kubernetes backend: a Kubeflow PyTorchJob from the spec, submitted and followed through the API server."""
