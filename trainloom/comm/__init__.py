"""trainloom.comm."""
