# An EFA training cluster in one availability zone: network (network.tf), the EFA security group and
# placement group, FSx for Lustre linked to the data bucket (fsx.tf), the checkpoint bucket
# (storage.tf), the instances' role (iam.tf), the ECR repository and log group (this file), and the
# launch template every job's instances start from (compute.tf). The jobs themselves are
# modules/job: one cluster serves many jobs of the same instance family.

data "aws_caller_identity" "current" {}
data "aws_region" "current" {}
data "aws_partition" "current" {}

locals {
  account_id = data.aws_caller_identity.current.account_id
  region     = data.aws_region.current.name
  partition  = data.aws_partition.current.partition
  tags       = merge(var.tags, { "trainyard:cluster" = var.name })

  # the node agents' log group (trainyard/container/node.py LOG_GROUP); one stream per host: <job>/algo-N
  log_group_name = "/trainyard/jobs"
  log_group_arn  = "arn:${local.partition}:logs:${local.region}:${local.account_id}:log-group:${local.log_group_name}"
}

# One customer-managed key for what the cluster stores: checkpoints, the file system, the image
# repository, the logs. (The instances' root volumes use EBS's AWS-managed key instead: a customer key
# on the volumes of spot instances also needs a grant for the EC2 Spot service-linked role.)
resource "aws_kms_key" "this" {
  description             = "Trainyard cluster ${var.name}: checkpoints, FSx, ECR, logs"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.kms.json
  tags                    = local.tags
}

resource "aws_kms_alias" "this" {
  name          = "alias/${var.name}"
  target_key_id = aws_kms_key.this.key_id
}

data "aws_iam_policy_document" "kms" {
  #checkov:skip=CKV_AWS_109:a key policy's resource "*" is this key only; the account root administers it, as AWS's default key policy does
  #checkov:skip=CKV_AWS_111:a key policy's resource "*" is this key only; the account root administers it, as AWS's default key policy does
  #checkov:skip=CKV_AWS_356:a key policy's resource "*" is this key only; the account root administers it, as AWS's default key policy does
  # the account administers the key through IAM, as with a key made in the console ("*" in a key
  # policy is this key)
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:${local.partition}:iam::${local.account_id}:root"]
    }
  }

  # CloudWatch Logs encrypts the log groups of this account (and only those) with the key
  statement {
    sid       = "CloudWatchLogs"
    actions   = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["logs.${local.region}.amazonaws.com"]
    }
    condition {
      test     = "ArnLike"
      variable = "kms:EncryptionContext:aws:logs:arn"
      values   = ["arn:${local.partition}:logs:${local.region}:${local.account_id}:log-group:*"]
    }
  }
}

# EFA's requirement: the instances of a job in one cluster placement group (one spine, lowest latency)
resource "aws_placement_group" "this" {
  name     = "${var.name}-efa"
  strategy = "cluster"
  tags     = local.tags
}

resource "aws_cloudwatch_log_group" "jobs" {
  count             = var.create_log_group ? 1 : 0
  name              = local.log_group_name
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.this.arn
  tags              = local.tags
}

resource "aws_ecr_repository" "this" {
  name                 = var.ecr_repository_name
  image_tag_mutability = "IMMUTABLE" # a tag names one image for ever: a job's image_uri cannot change under it
  force_delete         = var.force_destroy

  image_scanning_configuration {
    scan_on_push = true
  }

  encryption_configuration {
    encryption_type = "KMS"
    kms_key         = aws_kms_key.this.arn
  }

  tags = local.tags
}

resource "aws_ecr_lifecycle_policy" "this" {
  repository = aws_ecr_repository.this.name
  policy = jsonencode({
    rules = [{
      rulePriority = 1
      description  = "Expire untagged images (layers of failed pushes) after 14 days"
      selection = {
        tagStatus   = "untagged"
        countType   = "sinceImagePushed"
        countUnit   = "days"
        countNumber = 14
      }
      action = { type = "expire" }
    }]
  })
}
