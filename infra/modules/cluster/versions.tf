terraform {
  required_version = ">= 1.5.0, < 2.0.0"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # 5.x: aws_vpc_security_group_*_rule, aws_fsx_data_repository_association, aws_instance
      # instance_market_options; the 6.0 renames (aws_region.region) are not used yet
      version = "~> 5.60"
    }
  }
}
