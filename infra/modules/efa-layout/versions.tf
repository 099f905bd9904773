terraform {
  # Pure computation: no provider, so `terraform init` and `terraform validate` run offline on it.
  required_version = ">= 1.5.0, < 2.0.0"
}
