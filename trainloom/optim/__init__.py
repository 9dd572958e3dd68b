"""trainloom.optim."""
