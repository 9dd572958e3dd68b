"""trainloom.data."""
