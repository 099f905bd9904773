"""The EC2 backend: preflight checks, provisioning (placement group, EFA network interfaces, spot), a
detached controller per job that follows the nodes through object storage, billing and teardown."""
