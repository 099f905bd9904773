output "network_interfaces" {
  description = "One object per network interface, in network card order: network_card_index, device_index, interface_type and associate_public_ip_address (false on card 0, null elsewhere)."
  value       = local.network_interfaces
}
