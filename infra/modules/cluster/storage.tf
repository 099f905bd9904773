# The checkpoint bucket: versioned (an overwritten or deleted checkpoint can be recovered for
# checkpoint_noncurrent_days), encrypted with the cluster's key, never public, TLS only.

resource "aws_s3_bucket" "checkpoints" {
  #checkov:skip=CKV_AWS_144:cross-region replication of checkpoints is a cost the user opts into; versioning keeps them recoverable in the region
  #checkov:skip=CKV_AWS_18:server access logging needs a separate log bucket; requests are in CloudTrail's data events when the account records them
  #checkov:skip=CKV2_AWS_62:no consumer of event notifications: the SDK polls the checkpoint prefix
  bucket_prefix = "${var.name}-ckpt-"
  force_destroy = var.force_destroy
  tags          = local.tags
}

resource "aws_s3_bucket_versioning" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.this.arn
    }
    bucket_key_enabled = true # one data key per bucket and period, not a KMS call per object
  }
}

resource "aws_s3_bucket_public_access_block" "checkpoints" {
  bucket                  = aws_s3_bucket.checkpoints.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id
  rule {
    object_ownership = "BucketOwnerEnforced" # no ACLs: the bucket policy and IAM decide
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id

  rule {
    id     = "expire-old-versions"
    status = "Enabled"
    filter {}
    noncurrent_version_expiration {
      noncurrent_days = var.checkpoint_noncurrent_days
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = 7 # a checkpoint upload cut short leaves parts that cost storage
    }
  }

  depends_on = [aws_s3_bucket_versioning.checkpoints]
}

resource "aws_s3_bucket_policy" "checkpoints" {
  bucket     = aws_s3_bucket.checkpoints.id
  policy     = data.aws_iam_policy_document.checkpoints_tls.json
  depends_on = [aws_s3_bucket_public_access_block.checkpoints]
}

data "aws_iam_policy_document" "checkpoints_tls" {
  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.checkpoints.arn, "${aws_s3_bucket.checkpoints.arn}/*"]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}
