# The launch template every job's instances start from (modules/job sets the instance type, the user
# data and the job's tags). Its network interfaces, metadata options and security-group rules are
# those of trainyard/job/facts.py, which the EC2 backend sends: a test compares the two.

data "aws_ssm_parameter" "ami" {
  count = var.ami_id == null ? 1 : 0
  name  = var.ami_ssm_parameter
}

# The AMI's root device, on which the root volume is mapped, and its snapshot's size, below which EC2
# refuses a root volume (the EC2 backend reads the same with DescribeImages: trainyard/sdk/backends/ec2/provision.py
# image_root and root_volume_gib).
data "aws_ami" "this" {
  filter {
    name   = "image-id"
    values = [local.ami_id]
  }
}

locals {
  ami_id = var.ami_id != null ? var.ami_id : data.aws_ssm_parameter.ami[0].insecure_value
  # root_volume_size_gib, or the AMI's root snapshot when that is larger
  root_volume_gib = max(var.root_volume_size_gib, [
    for m in data.aws_ami.this.block_device_mappings : tonumber(lookup(m.ebs, "volume_size", "0"))
    if m.device_name == data.aws_ami.this.root_device_name
  ]...)
}

# card 0 device 0 "efa", device 0 of every further card "efa-only" (one plain interface without EFA)
module "efa_layout" {
  source         = "../efa-layout"
  efa_interfaces = var.efa_interfaces
}

resource "aws_launch_template" "this" {
  name_prefix            = "${var.name}-"
  description            = "Trainyard cluster ${var.name}: ${var.efa_interfaces} EFA interface(s), IMDSv2, placement group ${aws_placement_group.this.name}"
  image_id               = local.ami_id
  update_default_version = true
  ebs_optimized          = true
  # the user data powers the instance off when the node agent exits: that ends it for good
  instance_initiated_shutdown_behavior = "terminate"

  iam_instance_profile {
    arn = aws_iam_instance_profile.instance.arn
  }

  # IMDSv2 only; hop limit 1: the training container uses the host network (trainyard/job/facts.py IMDS_OPTIONS)
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  monitoring {
    enabled = true
  }

  placement {
    group_name = aws_placement_group.this.name
  }

  block_device_mappings {
    device_name = data.aws_ami.this.root_device_name
    ebs {
      volume_size           = local.root_volume_gib
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }

  dynamic "network_interfaces" {
    for_each = module.efa_layout.network_interfaces
    content {
      network_card_index          = network_interfaces.value.network_card_index
      device_index                = network_interfaces.value.device_index
      interface_type              = network_interfaces.value.interface_type
      associate_public_ip_address = network_interfaces.value.associate_public_ip_address
      subnet_id                   = aws_subnet.private.id
      security_groups             = [aws_security_group.efa.id]
      delete_on_termination       = true
    }
  }

  dynamic "tag_specifications" {
    for_each = toset(["instance", "volume", "network-interface"])
    content {
      resource_type = tag_specifications.value
      tags          = local.tags
    }
  }

  tags = local.tags
}
