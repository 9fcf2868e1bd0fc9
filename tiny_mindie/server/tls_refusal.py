"""Naming a refused TLS client and the certificate of its chain that failed, for the log.

OpenSSL forgets the client's certificates when they fail verification, and Python's ssl has no
verify callback and gives no error depth. Its TLS message hook (``SSLContext._msg_callback``, a
debugging aid since Python 3.8, called for handshake messages and record headers, never with
application data) sees the client's Certificate message: the certificates of it (at most
:data:`MAX_CHAIN`) are kept on the connection's SSLObject (our subclass, through the public
``sslobject_class``), which adds them to the verification error it raises. The hook is set on the
C context the way ssl.py's own setter does, without that setter's per-call enum conversions
(which cost more per record than the hook itself). Without the hook (another Python), refusals
are logged without the subject.

Which certificate of the chain failed is found again from the verify code and what the server
trusts (:class:`ChainFacts`: its CAs and the serials its CRLs revoke): for a revoked chain the
first certificate a CRL names (the leaf first, as OpenSSL checks them), for an expired one the
highest out of date, for a missing CRL the CA whose CRL is missing.
"""

from __future__ import annotations

import _ssl
import datetime
import ssl
from dataclasses import dataclass, field

MAX_CHAIN = 10      # certificates of a client's Certificate message kept for the log

_HANDSHAKE, _CERTIFICATE = 22, 11     # TLS content type and handshake message type
_NOT_YET_VALID, _EXPIRED, _NO_CRL_CODE, _INVALID_CA, _REVOKED = 9, 10, 3, 24, 23


def ssl_reason(exc: Exception) -> str:
    """A short lower-case reason of an ``ssl``/``OSError`` (OpenSSL's reason code spelled out)."""
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return exc.reason.lower().replace("_", " ")
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


@dataclass(frozen=True)
class ChainFacts:
    """What a server trusts, to find the failed certificate of a refused chain again.

    Attributes:
        cas: the CA certificates of ``tlsCaFile`` (``cryptography`` certificates).
        revoked: CRL issuer (an ``x509.Name``) -> the serial numbers its CRLs revoke.
    """

    cas: tuple = ()
    revoked: dict = field(default_factory=dict)

    @classmethod
    def of(cls, cas: list, crls: list) -> ChainFacts:
        """From the CA certificates and the CRLs (``cryptography`` objects) a server loaded."""
        revoked: dict = {}
        for crl in crls:
            revoked.setdefault(crl.issuer, set()).update(r.serial_number for r in crl)
        return cls(tuple(cas), {k: frozenset(v) for k, v in revoked.items()})

    def path(self, sent: list) -> list:
        """The chain from the client's certificate ``sent[0]`` up: each issuer found by name
        among the trusted CAs first (as OpenSSL does), then the certificates the client sent; it
        ends at a self-issued certificate, one whose issuer is unknown, or :data:`MAX_CHAIN`."""
        chain = [sent[0]]
        while len(chain) < MAX_CHAIN and chain[-1].issuer != chain[-1].subject:
            issuer = next((c for c in (*self.cas, *sent[1:]) if c.subject == chain[-1].issuer
                           and c not in chain), None)
            if issuer is None:
                break
            chain.append(issuer)
        return chain

    def failed(self, code: int, chain: list, now: datetime.datetime) -> int | None:
        """The depth in ``chain`` (0: the client's certificate) of the certificate that failed
        with OpenSSL's verify ``code``, or None when the code is not one looked for or no
        certificate matches it."""
        depths = range(len(chain))
        if code == _REVOKED:
            hits = [d for d in depths
                    if chain[d].serial_number in self.revoked.get(chain[d].issuer, ())]
        elif code == _NO_CRL_CODE:
            hits = [d for d in depths if chain[d].issuer not in self.revoked]
        elif code in (_EXPIRED, _NOT_YET_VALID):
            hits = [d for d in reversed(depths) if (chain[d].not_valid_after_utc < now
                    if code == _EXPIRED else chain[d].not_valid_before_utc > now)]
        elif code == _INVALID_CA:
            hits = [d for d in depths[1:] if not is_ca(chain[d])]
        else:
            return None
        return hits[0] if hits else None


def is_ca(cert) -> bool:
    """A CA certificate (``cryptography``): basicConstraints CA:TRUE, or (X.509 v1, no extension)
    self-issued, as OpenSSL counts it."""
    from cryptography import x509
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return cert.subject == cert.issuer


class ServerSSLObject(ssl.SSLObject):
    """An SSLObject whose failed certificate verification carries the client's certificates
    (``client_chain``: DER, as sent) and what the server trusts (``chain_facts``)."""

    client_chain: tuple[bytes, ...] = ()
    facts: ChainFacts | None = None     # set on the per-context subclass

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
        except ssl.SSLCertVerificationError as exc:
            exc.client_chain, exc.chain_facts = self.client_chain, self.facts
            raise
        self.client_chain = ()


def _on_tls_message(conn, direction, version, content_type, msg_type, data) -> None:
    if content_type == _HANDSHAKE and msg_type == _CERTIFICATE and direction == "read" \
            and isinstance(conn, ServerSSLObject):
        conn.client_chain = certificate_list(data)


def certificate_list(msg: bytes) -> tuple[bytes, ...]:
    """The certificates (DER, at most :data:`MAX_CHAIN`) of a TLS 1.3 Certificate handshake
    message (RFC 8446 §4.4.2: 4-byte header, request context, 3-byte list length, then per entry
    a 3-byte length + DER and 2-byte length + extensions); a truncated entry ends the list."""
    if len(msg) < 5:
        return ()
    pos = 5 + msg[4] + 3                       # header, context length + context, list length
    certs = []
    while len(certs) < MAX_CHAIN and pos + 3 <= len(msg):
        n = int.from_bytes(msg[pos:pos + 3], "big")
        der = msg[pos + 3:pos + 3 + n]
        if not n or len(der) != n:
            break
        certs.append(der)
        pos += 3 + n
        pos += 2 + int.from_bytes(msg[pos:pos + 2], "big")
    return tuple(certs)


_on_tls_message.user_function = _on_tls_message   # what ssl.py's _msg_callback getter returns
_C_MSG_HOOK = vars(_ssl._SSLContext).get("_msg_callback")


def name_refused_clients(ctx: ssl.SSLContext, facts: ChainFacts) -> None:
    """Have ``ctx``'s failed verifications carry the client's chain and ``facts`` for
    :func:`describe_refusal`."""
    ctx.sslobject_class = type("ServerSSLObject", (ServerSSLObject,), {"facts": facts})
    if _C_MSG_HOOK is not None:
        _C_MSG_HOOK.__set__(ctx, _on_tls_message)


def describe_refusal(exc: BaseException) -> tuple[str, str]:
    """Why a server-side TLS handshake failed, for the log, as ``(why, client)``: OpenSSL's verify
    message (``certificate revoked``, ...; a missing CRL says which CRLs are needed) or reason
    (``peer did not return a certificate``, ...); ``client`` names the client certificate's
    subject, serial and issuer (``"; client certificate ..."``) when the client sent one, after
    the certificate of its chain that failed when that is a CA's (``"; failed certificate ..."``,
    ``"; no CRL of ..."``)."""
    why = ssl_reason(exc) if isinstance(exc, ssl.SSLError) else str(exc) or type(exc).__name__
    code = getattr(exc, "verify_code", None)
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = f"{exc.verify_message} (verify code {code}){_NO_CRL[code == _NO_CRL_CODE]}"
    sent = _load(getattr(exc, "client_chain", ()))
    if not sent:           # none sent, or one cryptography cannot read
        return why, ""
    leaf = sent[0]
    client = (f"; client certificate {leaf.subject.rfc4514_string()!r}, "
              f"serial {leaf.serial_number:x}, issuer {leaf.issuer.rfc4514_string()!r}")
    facts = getattr(exc, "chain_facts", None)
    if facts is None or code is None:
        return why, client
    chain = facts.path(sent)
    depth = facts.failed(code, chain, datetime.datetime.now(datetime.UTC))
    if depth is None:
        return why, client
    cert = chain[depth]
    if code == _NO_CRL_CODE:
        return why, f"; no CRL of {cert.issuer.rfc4514_string()!r}{client}"
    if depth == 0:
        return why, client
    return why, (f"; failed certificate {cert.subject.rfc4514_string()!r} (depth {depth} of the "
                 f"chain), serial {cert.serial_number:x}, issuer "
                 f"{cert.issuer.rfc4514_string()!r}{client}")


def _load(ders) -> list:
    """The certificates of ``ders`` that ``cryptography`` reads, up to the first it cannot."""
    from cryptography import x509
    certs = []
    for der in ders:
        try:
            certs.append(x509.load_der_x509_certificate(der))
        except ValueError:
            break
    return certs


_NO_CRL = ("", ": every CA of the client's chain, an intermediate too, needs its CRL in "
               "tlsCrlFiles and its certificate in tlsCaFile")
