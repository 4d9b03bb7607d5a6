from lmcache_ec_broker import BrokerClient


def test_broker_starts_and_answers(broker):
    with BrokerClient(broker.socket_path) as c:
        assert c.ping()
        assert c.stats()["clients"] == 1
