// A real OpenID provider for the tests: the npm `oidc-provider` package, issuing JWT access tokens
// for a resource indicator (RFC 8707), as a team's identity provider would.
//
// Started by tests/support/oidc.py, which copies this file next to the installed package. It prints
// one JSON line `{"issuer": ...}` once it listens. Accounts: any login name signs in (the package's
// development login form); the names in OPERATORS are granted the operator scope.
//
// Clients (all for tests only):
//   agent-*       client_credentials, scope "mcp"; the suffix picks the signing algorithm:
//                 agent-alice / agent-bob RS256, agent-es ES256, agent-ed EdDSA, agent-hs HS256
//   ops-*         client_credentials, scope "commitgate:operator" (ops-carol decides for alice only)
//   plain-client  client_credentials, scope "profile:read" (neither the agent's nor the operator's)
//   console       public client (PKCE), authorization code; its redirect URIs are set with /__test/clients
//
// Test-only endpoints beside the provider:
//   POST /__test/rotate   {"mode": "roll"}: sign with the published next key of each algorithm from now
//                         on and publish a fresh next key; {"mode": "replace"}: sign with brand-new keys
//   POST /__test/sign     {"claims": {...}, "alg": "RS256"}: a JWT signed with the current key (to make
//                         expired or not-yet-valid tokens that only the clock makes wrong)
//   POST /__test/clients  {"redirect_uris": [...]}: the console client's redirect URIs
import * as crypto from 'node:crypto';
import * as http from 'node:http';

import Provider from 'oidc-provider';
import * as jose from 'jose';

const AGENT_SCOPE = 'mcp';
const OPERATOR_SCOPE = 'commitgate:operator';
const OPERATORS = { carol: ['alice'], dave: ['*'] };
const PRINCIPALS_CLAIM = 'commitgate_principals';
const HMAC_SECRET = crypto.randomBytes(32);
const port = Number(process.env.OIDC_PORT || 0);

let generation = 0;
function newKeys() {
  generation += 1;
  const make = (type, options, alg) => {
    const { privateKey } = crypto.generateKeyPairSync(type, options);
    return { ...privateKey.export({ format: 'jwk' }), kid: `${alg.toLowerCase()}-${generation}`, alg, use: 'sig' };
  };
  return [
    make('rsa', { modulusLength: 2048 }, 'RS256'),
    make('ec', { namedCurve: 'P-256' }, 'ES256'),
    make('ed25519', {}, 'EdDSA'),
  ];
}

const state = { signing: newKeys(), next: newKeys(), redirectUris: ['http://127.0.0.1/unused'] };

function signingAlg(client) {
  const id = client?.clientId || '';
  if (id.endsWith('-es')) return { alg: 'ES256' };
  if (id.endsWith('-ed')) return { alg: 'EdDSA' };
  if (id.endsWith('-hs')) return { alg: 'HS256', key: HMAC_SECRET };
  return { alg: 'RS256' };
}

function clients() {
  const credentials = (id, scope) => ({
    client_id: id,
    client_secret: `${id}-secret`,
    grant_types: ['client_credentials'],
    response_types: [],
    redirect_uris: [],
    scope,
  });
  return [
    ...['agent-alice', 'agent-bob', 'agent-es', 'agent-ed', 'agent-hs'].map((id) => credentials(id, AGENT_SCOPE)),
    credentials('ops-carol', OPERATOR_SCOPE),
    credentials('ops-dave', OPERATOR_SCOPE),
    credentials('plain-client', 'profile:read'),
    {
      client_id: 'console',
      token_endpoint_auth_method: 'none',
      grant_types: ['authorization_code'],
      response_types: ['code'],
      redirect_uris: state.redirectUris,
    },
  ];
}

// An operator's principals: an account's by its login name, a client's by its id (ops-carol → carol).
function operatorOf(name) {
  return OPERATORS[(name || '').replace(/^ops-/, '')];
}

function build(issuer) {
  const provider = new Provider(issuer, {
    clients: clients(),
    jwks: { keys: [...state.signing, ...state.next] },
    scopes: ['openid', AGENT_SCOPE, OPERATOR_SCOPE, 'profile:read'],
    pkce: { required: () => true },
    cookies: { keys: ['test-cookie-key'] },
    findAccount: async (ctx, sub) => ({ accountId: sub, claims: async () => ({ sub }) }),
    features: {
      devInteractions: { enabled: true },
      clientCredentials: { enabled: true },
      resourceIndicators: {
        enabled: true,
        defaultResource: () => undefined,
        useGrantedResource: () => true,
        getResourceServerInfo: async (ctx, resource, client) => {
          // A person gets the operator scope only if they are one; a client as its registration says.
          const account = ctx.oidc.account?.accountId;
          const operator = account === undefined || operatorOf(account) !== undefined;
          return {
            scope: operator ? `${AGENT_SCOPE} ${OPERATOR_SCOPE}` : AGENT_SCOPE,
            audience: resource,
            accessTokenTTL: 600,
            accessTokenFormat: 'jwt',
            jwt: { sign: signingAlg(client) },
          };
        },
      },
    },
    extraTokenClaims: async (ctx, token) => {
      const principals = operatorOf(token.accountId || token.clientId);
      return principals ? { [PRINCIPALS_CLAIM]: principals } : undefined;
    },
  });
  provider.proxy = false;
  return provider;
}

async function readJson(req) {
  const chunks = [];
  for await (const chunk of req) chunks.push(chunk);
  return chunks.length ? JSON.parse(Buffer.concat(chunks).toString('utf8')) : {};
}

let current;
let issuer;

async function admin(req, res) {
  const body = await readJson(req);
  if (req.url === '/__test/rotate') {
    if (body.mode === 'replace') {
      state.signing = newKeys(); // keys nobody has seen: a verifier must fetch the set again
    } else {
      // The published next keys sign from now on (the first key of an algorithm signs); the
      // previous ones stay published for the tokens already out.
      state.signing = [...state.next, ...state.signing];
    }
    state.next = newKeys();
  } else if (req.url === '/__test/clients') {
    state.redirectUris = body.redirect_uris;
  } else if (req.url === '/__test/sign') {
    const jwk = state.signing.find((k) => k.alg === (body.alg || 'RS256'));
    const key = await jose.importJWK(jwk, jwk.alg);
    const token = await new jose.SignJWT(body.claims).setProtectedHeader({ alg: jwk.alg, kid: jwk.kid, typ: 'at+jwt' }).sign(key);
    res.writeHead(200, { 'content-type': 'application/json' });
    res.end(JSON.stringify({ token }));
    return;
  } else {
    res.writeHead(404);
    res.end();
    return;
  }
  current = build(issuer);
  res.writeHead(200, { 'content-type': 'application/json' });
  res.end(JSON.stringify({ kids: [...state.signing, ...state.next].map((k) => k.kid) }));
}

const server = http.createServer((req, res) => {
  if (req.url.startsWith('/__test/')) {
    admin(req, res).catch((err) => {
      res.writeHead(500);
      res.end(String(err));
    });
    return;
  }
  current.callback()(req, res);
});

server.listen(port, '127.0.0.1', () => {
  issuer = `http://127.0.0.1:${server.address().port}`;
  current = build(issuer);
  process.stdout.write(`${JSON.stringify({ issuer })}\n`);
});

for (const signal of ['SIGTERM', 'SIGINT']) process.on(signal, () => process.exit(0));
