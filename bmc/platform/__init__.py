"""What bmc needs from the machine, one home each: memory mappings and huge pages (hugepages.py), free ports
(ports.py) and the CPU topology (topology.py)."""
