# The instances of one job, launched from the cluster's launch template, and the job's spec.json in
# its state prefix (the node agents read it at boot).
#
# Host index: the EC2 backend launches all N instances in one RunInstances and each agent takes its
# AMI launch index (0..N-1) as its host index. Terraform launches each aws_instance with a
# RunInstances of its own, so every launch index here is 0; each instance carries its index in the
# trainyard:host-index tag instead (trainyard/job/facts.py HOST_INDEX_TAG), which the node agent prefers to
# the launch index (trainyard/container/peers.py host_index).

locals {
  # Terraform launches the first attempt only: an interrupted spot job is not relaunched by itself
  attempt  = 1
  job_tags = merge(var.tags, { "trainyard:job" = var.job_name, "trainyard:attempt" = tostring(local.attempt) })
  # s3://bucket/key -> [bucket, key]
  state = regex("^s3://([^/]+)/(.+)$", var.state_s3_uri)
  code  = var.code_s3_uri == null ? null : regex("^s3://([^/]+)/(.+)$", var.code_s3_uri)
  # network interfaces per instance (one plain interface without EFA)
  interfaces = max(var.efa_interfaces, 1)
}

resource "aws_s3_object" "spec" {
  bucket       = local.state[0]
  key          = "${local.state[1]}/spec.json"
  content      = var.spec_json
  content_type = "application/json"
  tags         = local.job_tags

  lifecycle {
    precondition {
      condition     = jsondecode(var.spec_json).job_name == var.job_name
      error_message = "spec_json is the spec of another job than job_name."
    }
  }
}

resource "aws_s3_object" "code" {
  count        = var.code_archive_path == null ? 0 : 1
  bucket       = local.code[0]
  key          = local.code[1]
  source       = var.code_archive_path
  source_hash  = filemd5(var.code_archive_path)
  content_type = "application/gzip"
  tags         = local.job_tags

  lifecycle {
    precondition {
      condition     = var.code_s3_uri != null
      error_message = "code_archive_path needs code_s3_uri (where the archive goes)."
    }
  }
}

resource "aws_instance" "this" {
  #checkov:skip=CKV_AWS_8:the root volume is the launch template's, encrypted (modules/cluster block_device_mappings); a root_block_device here would replace it
  #checkov:skip=CKV2_AWS_41:the instance profile is the launch template's (modules/cluster iam_instance_profile)
  count         = var.instance_count
  instance_type = var.instance_type
  # AMI, network interfaces (EFA, subnet, security group, no public IP), placement group, instance
  # profile, root volume and shutdown behaviour come from the cluster's launch template
  launch_template {
    id      = var.launch_template_id
    version = var.launch_template_version
  }
  user_data                   = var.user_data
  user_data_replace_on_change = true
  monitoring                  = true
  ebs_optimized               = true

  # as in the launch template (trainyard/job/facts.py IMDS_OPTIONS), stated here too so the instances keep
  # them whatever template version they start from
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  dynamic "instance_market_options" {
    for_each = var.use_spot ? [1] : []
    content {
      market_type = "spot"
      spot_options {
        spot_instance_type             = "one-time"
        instance_interruption_behavior = "terminate"
      }
    }
  }

  tags = merge(local.job_tags, {
    "trainyard:host-index" = tostring(count.index)
    Name                   = "${var.job_name}-algo-${count.index + 1}"
  })
  volume_tags = merge(local.job_tags, { Name = "${var.job_name}-algo-${count.index + 1}" })

  # the agents read spec.json (and the code) as soon as they start
  depends_on = [aws_s3_object.spec, aws_s3_object.code]
}

# The job's tags on every network interface of its instances (the launch template's interfaces carry
# only the cluster's tags): one aws_ec2_tag per interface and tag.
data "aws_network_interfaces" "this" {
  count = var.instance_count
  filter {
    name   = "attachment.instance-id"
    values = [aws_instance.this[count.index].id]
  }
}

resource "aws_ec2_tag" "interfaces" {
  for_each = {
    for t in setproduct(range(var.instance_count), range(local.interfaces), keys(local.job_tags)) :
    "${t[0]}/${t[1]}/${t[2]}" => { instance = t[0], interface = t[1], key = t[2] }
  }
  resource_id = sort(data.aws_network_interfaces.this[each.value.instance].ids)[each.value.interface]
  key         = each.value.key
  value       = local.job_tags[each.value.key]
}
