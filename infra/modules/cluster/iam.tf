# The instances' role: what the user data and the node agent call, and nothing else.
#   S3      read/write: the checkpoint bucket, output_s3_uri (spec.json, status objects, artifacts,
#           uploaded code), write_s3_uris; read: the data bucket's linked prefix, read_s3_uris
#   KMS     the cluster's key (objects in the checkpoint bucket are encrypted with it)
#   ECR     pull from the cluster's repository (and ecr_pull_repository_arns)
#   Logs    streams of the /trainyard/jobs log group (and the group itself when create_log_group is off)
#   EC2     DescribeInstances: the agent finds its peers (and its own host index) by tag

locals {
  read_write_uris = distinct(concat([var.output_s3_uri], var.write_s3_uris))
  data_uris       = var.data_bucket_name == null ? [] : ["s3://${var.data_bucket_name}/${var.data_s3_prefix}"]
  read_uris       = distinct(concat(var.read_s3_uris, local.data_uris))
  # s3://bucket/some/prefix -> bucket, prefix ("" for a whole bucket) and the ARN of its objects
  s3_locations = {
    for u in distinct(concat(local.read_write_uris, local.read_uris)) : u => {
      bucket = regex("^s3://([^/]+)", u)[0]
      prefix = trim(replace(u, "/^s3://[^/]+/?/", ""), "/")
    }
  }
  object_arns = {
    for u, l in local.s3_locations :
    u => l.prefix == "" ? "arn:${local.partition}:s3:::${l.bucket}/*" : "arn:${local.partition}:s3:::${l.bucket}/${l.prefix}/*"
  }
  # the s3:prefix values ListBucket is allowed with, by bucket
  list_prefixes = {
    for l in values(local.s3_locations) : l.bucket => l.prefix == "" ? ["*"] : [l.prefix, "${l.prefix}/*"]...
  }
}

resource "aws_iam_role" "instance" {
  name               = "${var.name}-instance"
  description        = "Trainyard cluster ${var.name}: the training instances"
  assume_role_policy = data.aws_iam_policy_document.instance_assume.json
  tags               = local.tags
}

data "aws_iam_policy_document" "instance_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_instance_profile" "instance" {
  name = "${var.name}-instance"
  role = aws_iam_role.instance.name
  tags = local.tags
}

resource "aws_iam_role_policy" "instance" {
  name   = "trainyard-node"
  role   = aws_iam_role.instance.id
  policy = data.aws_iam_policy_document.instance.json
}

data "aws_iam_policy_document" "instance" {
  statement {
    sid       = "ListCheckpointBucket"
    actions   = ["s3:ListBucket", "s3:GetBucketLocation"]
    resources = [aws_s3_bucket.checkpoints.arn]
  }

  dynamic "statement" {
    for_each = local.list_prefixes
    content {
      actions   = ["s3:ListBucket"]
      resources = ["arn:${local.partition}:s3:::${statement.key}"]
      condition {
        test     = "StringLike"
        variable = "s3:prefix"
        values   = distinct(flatten(statement.value))
      }
    }
  }

  statement {
    sid = "ReadWriteObjects"
    actions = [
      "s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts",
    ]
    resources = concat(
      ["${aws_s3_bucket.checkpoints.arn}/*"],
      [for u in local.read_write_uris : local.object_arns[u]],
    )
  }

  dynamic "statement" {
    for_each = length(local.read_uris) > 0 ? [1] : []
    content {
      sid       = "ReadObjects"
      actions   = ["s3:GetObject"]
      resources = [for u in local.read_uris : local.object_arns[u]]
    }
  }

  statement {
    sid       = "ClusterKey"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.this.arn]
  }

  statement {
    sid       = "EcrLogin"
    actions   = ["ecr:GetAuthorizationToken"] # account-wide by design: no resource-level permission exists
    resources = ["*"]
  }

  statement {
    sid       = "EcrPull"
    actions   = ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"]
    resources = concat([aws_ecr_repository.this.arn], var.ecr_pull_repository_arns)
  }

  statement {
    sid       = "JobLogs"
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
    resources = [local.log_group_arn, "${local.log_group_arn}:log-stream:*"]
  }

  # without the module's log group, the agents create it on first use (trainyard/container/logship.py)
  dynamic "statement" {
    for_each = var.create_log_group ? [] : [1]
    content {
      sid       = "CreateJobLogGroup"
      actions   = ["logs:CreateLogGroup"]
      resources = [local.log_group_arn]
    }
  }

  statement {
    sid = "PeerDiscovery"
    # DescribeInstances supports no resource-level permissions or tag conditions: it cannot be scoped
    # below "*". It reveals instance metadata of the account, not data.
    actions   = ["ec2:DescribeInstances"]
    resources = ["*"]
  }
}
