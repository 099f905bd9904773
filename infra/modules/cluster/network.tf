# The VPC, the instances' private subnet in the one zone, the ways out of it, and the EFA security group.
#
# Instances with several EFA interfaces get no public IP (EC2 refuses one), so they reach AWS through
# VPC endpoints: S3 (gateway: code, channels, checkpoints, status objects, ECR's image layers), ECR
# api + dkr (docker login and pull), CloudWatch Logs (the node agent's log stream) and EC2
# (DescribeInstances: the agent's peer discovery). enable_nat_gateway adds a way to the internet.

locals {
  private_cidr = cidrsubnet(var.vpc_cidr, 2, 0)   # the first quarter: instances and FSx interfaces
  public_cidr  = cidrsubnet(var.vpc_cidr, 8, 255) # the last /24 of a /16 (/28 of a /20): the NAT gateway
  # interface endpoints of the services the instances call, by the name of the endpoint service
  interface_endpoints = toset(["ecr.api", "ecr.dkr", "logs", "ec2"])
}

resource "aws_vpc" "this" {
  cidr_block           = var.vpc_cidr
  enable_dns_support   = true # the interface endpoints' private DNS names resolve only with both
  enable_dns_hostnames = true
  tags                 = merge(local.tags, { Name = var.name })
}

# the VPC's default group, emptied: nothing may use it by accident
resource "aws_default_security_group" "this" {
  vpc_id = aws_vpc.this.id
  tags   = merge(local.tags, { Name = "${var.name}-default-unused" })
}

resource "aws_subnet" "private" {
  vpc_id                  = aws_vpc.this.id
  cidr_block              = local.private_cidr
  availability_zone_id    = var.availability_zone_id
  map_public_ip_on_launch = false
  tags                    = merge(local.tags, { Name = "${var.name}-private" })
}

resource "aws_route_table" "private" {
  vpc_id = aws_vpc.this.id
  tags   = merge(local.tags, { Name = "${var.name}-private" })
}

resource "aws_route_table_association" "private" {
  subnet_id      = aws_subnet.private.id
  route_table_id = aws_route_table.private.id
}

resource "aws_vpc_endpoint" "s3" {
  vpc_id            = aws_vpc.this.id
  service_name      = "com.amazonaws.${local.region}.s3"
  vpc_endpoint_type = "Gateway"
  route_table_ids   = [aws_route_table.private.id]
  tags              = merge(local.tags, { Name = "${var.name}-s3" })
}

resource "aws_vpc_endpoint" "interface" {
  for_each            = local.interface_endpoints
  vpc_id              = aws_vpc.this.id
  service_name        = "com.amazonaws.${local.region}.${each.value}"
  vpc_endpoint_type   = "Interface"
  subnet_ids          = [aws_subnet.private.id]
  security_group_ids  = [aws_security_group.endpoints.id]
  private_dns_enabled = true
  tags                = merge(local.tags, { Name = "${var.name}-${each.value}" })
}

resource "aws_security_group" "endpoints" {
  name        = "${var.name}-endpoints"
  description = "Trainyard ${var.name}: HTTPS from the VPC to the interface endpoints"
  vpc_id      = aws_vpc.this.id
  tags        = merge(local.tags, { Name = "${var.name}-endpoints" })
}

resource "aws_vpc_security_group_ingress_rule" "endpoints_https" {
  security_group_id = aws_security_group.endpoints.id
  description       = "HTTPS from the VPC"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = aws_vpc.this.cidr_block
}

# ---- the EFA security group: what trainyard/job/facts.py security_group_rules says, rule for rule (a test
# compares them). EFA needs all traffic from and to the group itself; FSx for Lustre's servers and
# clients talk on TCP 988 and 1018-1023 (the file system's interfaces are in this group too).

resource "aws_security_group" "efa" {
  name        = "${var.name}-efa"
  description = "Trainyard ${var.name}: EFA (all traffic within the group), Lustre from the VPC, all egress"
  vpc_id      = aws_vpc.this.id
  tags        = merge(local.tags, { Name = "${var.name}-efa" })
}

resource "aws_vpc_security_group_ingress_rule" "efa_self" {
  security_group_id            = aws_security_group.efa.id
  description                  = "EFA: all traffic from the group itself"
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.efa.id
}

resource "aws_vpc_security_group_ingress_rule" "lustre_988" {
  security_group_id = aws_security_group.efa.id
  description       = "FSx for Lustre: TCP 988 from the VPC"
  ip_protocol       = "tcp"
  from_port         = 988
  to_port           = 988
  cidr_ipv4         = aws_vpc.this.cidr_block
}

resource "aws_vpc_security_group_ingress_rule" "lustre_1018_1023" {
  security_group_id = aws_security_group.efa.id
  description       = "FSx for Lustre: TCP 1018-1023 from the VPC"
  ip_protocol       = "tcp"
  from_port         = 1018
  to_port           = 1023
  cidr_ipv4         = aws_vpc.this.cidr_block
}

resource "aws_vpc_security_group_egress_rule" "efa_self" {
  security_group_id            = aws_security_group.efa.id
  description                  = "EFA: all traffic to the group itself"
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.efa.id
}

resource "aws_vpc_security_group_egress_rule" "all" {
  #checkov:skip=CKV_AWS_382:all egress is EFA's documented requirement (trainyard/job/facts.py); the subnet has no route out but the VPC endpoints (and the optional NAT gateway)
  security_group_id = aws_security_group.efa.id
  description       = "All egress: VPC endpoints, FSx, peers (and the NAT gateway when enabled)"
  ip_protocol       = "-1"
  cidr_ipv4         = "0.0.0.0/0"
}

# ---- optional: a NAT gateway in a small public subnet

resource "aws_internet_gateway" "this" {
  count  = var.enable_nat_gateway ? 1 : 0
  vpc_id = aws_vpc.this.id
  tags   = merge(local.tags, { Name = var.name })
}

resource "aws_subnet" "public" {
  count                   = var.enable_nat_gateway ? 1 : 0
  vpc_id                  = aws_vpc.this.id
  cidr_block              = local.public_cidr
  availability_zone_id    = var.availability_zone_id
  map_public_ip_on_launch = false # only the NAT gateway lives here, with its own Elastic IP
  tags                    = merge(local.tags, { Name = "${var.name}-public" })
}

resource "aws_route_table" "public" {
  count  = var.enable_nat_gateway ? 1 : 0
  vpc_id = aws_vpc.this.id
  tags   = merge(local.tags, { Name = "${var.name}-public" })
}

resource "aws_route" "public_internet" {
  count                  = var.enable_nat_gateway ? 1 : 0
  route_table_id         = aws_route_table.public[0].id
  destination_cidr_block = "0.0.0.0/0"
  gateway_id             = aws_internet_gateway.this[0].id
}

resource "aws_route_table_association" "public" {
  count          = var.enable_nat_gateway ? 1 : 0
  subnet_id      = aws_subnet.public[0].id
  route_table_id = aws_route_table.public[0].id
}

resource "aws_eip" "nat" {
  count  = var.enable_nat_gateway ? 1 : 0
  domain = "vpc"
  tags   = merge(local.tags, { Name = "${var.name}-nat" })
}

resource "aws_nat_gateway" "this" {
  count         = var.enable_nat_gateway ? 1 : 0
  allocation_id = aws_eip.nat[0].id
  subnet_id     = aws_subnet.public[0].id
  tags          = merge(local.tags, { Name = var.name })
  depends_on    = [aws_internet_gateway.this]
}

resource "aws_route" "private_nat" {
  count                  = var.enable_nat_gateway ? 1 : 0
  route_table_id         = aws_route_table.private.id
  destination_cidr_block = "0.0.0.0/0"
  nat_gateway_id         = aws_nat_gateway.this[0].id
}

# ---- flow logs

resource "aws_flow_log" "this" {
  count                = var.enable_flow_logs ? 1 : 0
  vpc_id               = aws_vpc.this.id
  traffic_type         = "ALL"
  log_destination_type = "cloud-watch-logs"
  log_destination      = aws_cloudwatch_log_group.flow[0].arn
  iam_role_arn         = aws_iam_role.flow[0].arn
  tags                 = local.tags
}

resource "aws_cloudwatch_log_group" "flow" {
  count             = var.enable_flow_logs ? 1 : 0
  name              = "/trainyard/vpc/${var.name}"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.this.arn
  tags              = local.tags
}

resource "aws_iam_role" "flow" {
  count              = var.enable_flow_logs ? 1 : 0
  name               = "${var.name}-flow-logs"
  assume_role_policy = data.aws_iam_policy_document.flow_assume.json
  tags               = local.tags
}

data "aws_iam_policy_document" "flow_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["vpc-flow-logs.amazonaws.com"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account_id]
    }
  }
}

resource "aws_iam_role_policy" "flow" {
  count  = var.enable_flow_logs ? 1 : 0
  name   = "write-flow-logs"
  role   = aws_iam_role.flow[0].id
  policy = data.aws_iam_policy_document.flow.json
}

data "aws_iam_policy_document" "flow" {
  statement {
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
    resources = ["arn:${local.partition}:logs:${local.region}:${local.account_id}:log-group:/trainyard/vpc/${var.name}:*"]
  }
}
