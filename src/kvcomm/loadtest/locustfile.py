"""The locustfile ``kvcomm loadtest`` runs: the four scenarios' agents (``users.py``).

Run one scenario yourself (the web UI, or headless) by naming its user class::

    locust -f "$(python -c 'import kvcomm.loadtest as t; print(t.LOCUSTFILE)')" \\
        SwarmDrone --kvcomm-config host-1.yaml            # then open http://localhost:8089
    locust -f ... WarehouseRobot --headless -u 16 -t 60s --kvcomm-backend redis \\
        --kvcomm-redis 127.0.0.1:6379

Options: ``--kvcomm-backend kvcomm|redis``, ``--kvcomm-config FILE``, ``--kvcomm-name NS``,
``--kvcomm-redis HOST:PORT``, ``--kvcomm-rate HZ``, ``--kvcomm-out FILE.json``,
``--kvcomm-seed N``.
"""

from kvcomm.loadtest.users import HotKeyReader, PenetrationProber, SwarmDrone, WarehouseRobot

__all__ = ["HotKeyReader", "PenetrationProber", "SwarmDrone", "WarehouseRobot"]
