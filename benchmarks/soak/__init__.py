"""The soak benchmarks' parts (soak_adversarial.py, soak_mixed.py): the request pool and its malformed kinds
(requests.py), the well-behaved clients (clients.py), the adversaries' process (adversaries.py) and the table
(figures.py)."""
