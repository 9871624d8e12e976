"""Front end: a user's model becomes a standalone FX graph of ATen ops."""
