"""Terraform rendering of an EC2 job (`Estimator.to_terraform`, `trainyard render terraform`)."""
