# The network interfaces of one instance, as trainyard/job/facts.py `network_interfaces` lays them out (a test
# compares the two for several counts):
#   - card 0, device 0: an "efa" interface (EFA plus the instance's private IP), never a public IP
#     (EC2 refuses one with several interfaces);
#   - device 0 of every further card: "efa-only" (EFA without an IP address, which saves addresses);
#   - without EFA: one plain "interface".
# Subnet, security group and delete-on-termination are the caller's (the cluster's launch template).
locals {
  network_interfaces = [
    for card in range(max(var.efa_interfaces, 1)) : {
      network_card_index          = card
      device_index                = 0
      interface_type              = var.efa_interfaces == 0 ? "interface" : (card == 0 ? "efa" : "efa-only")
      associate_public_ip_address = card == 0 ? false : null
    }
  ]
}
