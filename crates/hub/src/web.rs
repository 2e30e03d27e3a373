//! The registry's read-only web pages: the list with search (`/`) and an
//! environment's page (`/{owner}/{name}`: README, versions with their validation,
//! lineage, leaderboard). Rendered on the server with minijinja (auto-escaped); a
//! README's Markdown is rendered with raw HTML shown as text and with links and
//! images kept only when they lead to http, https, mailto (links) or a relative
//! address, so a package cannot put script on the page. Every response also carries
//! a Content-Security-Policy that allows no script at all ([`security_headers`]).

use std::sync::{Arc, LazyLock};

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use minijinja::{Environment, context};
use serde::Deserialize;

use crate::api::{SearchQuery, SearchSort};
use crate::registry::{Registry, RegistryError};

const BASE: &str = r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{% block title %}agentstack hub{% endblock %}</title>
<style>
body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
a{color:#0645ad;text-decoration:none} a:hover{text-decoration:underline}
table{border-collapse:collapse;width:100%;margin:.5rem 0 1.5rem} th,td{text-align:left;padding:.3rem .6rem;border-bottom:1px solid #ddd}
.muted{color:#666} .passed{color:#176f2c} .failed{color:#b00020} .pending,.incomplete{color:#8a6d00}
code,pre{background:#f5f5f5;border-radius:3px} pre{padding:.6rem;overflow:auto}
.readme{border:1px solid #ddd;border-radius:4px;padding:0 1rem;margin-bottom:1.5rem}
input[type=search]{width:20rem;padding:.3rem}
</style></head><body>
<header><a href="/"><strong>agentstack hub</strong></a></header>
{% block body %}{% endblock %}
</body></html>"#;

const INDEX: &str = r#"{% extends "base.html" %}
{% block body %}
<form method="get" action="/"><input type="search" name="q" value="{{ q }}" placeholder="Search environments">
<select name="sort">{% for s in ["relevance", "downloads", "score"] %}<option{% if s == sort %} selected{% endif %}>{{ s }}</option>{% endfor %}</select>
<button>Search</button></form>
<table id="packages"><tr><th>environment</th><th>latest</th><th>description</th><th>downloads</th><th>best score</th></tr>
{% for p in results %}<tr><td><a href="/{{ p.owner }}/{{ p.name }}">{{ p.owner }}/{{ p.name }}</a></td><td>{{ p.latest or "" }}</td>
<td>{{ p.description }}{% for t in p.tags %} <span class="muted">#{{ t }}</span>{% endfor %}</td><td>{{ p.downloads }}</td>
<td>{% if p.best_score is not none %}{{ "%.3f"|format(p.best_score) }}{% endif %}</td></tr>
{% else %}<tr><td colspan="5" class="muted">No environments{% if q %} match “{{ q }}”{% endif %}.</td></tr>{% endfor %}
</table>
{% endblock %}"#;

const PACKAGE: &str = r#"{% extends "base.html" %}
{% block title %}{{ p.owner }}/{{ p.name }} · agentstack hub{% endblock %}
{% block body %}
<h1 id="name">{{ p.owner }}/{{ p.name }}{% if p.private %} <span class="muted">(private)</span>{% endif %}</h1>
<p id="description">{{ p.description }}</p>
<p class="muted">{{ p.downloads }} downloads{% for t in p.tags %} · #{{ t }}{% endfor %}</p>
{% if p.parent %}<p id="lineage">Forked from <a href="/{{ p.parent.package }}">{{ p.parent.package }}</a>@{{ p.parent.version }}</p>{% endif %}
{% if p.forks %}<p>Forks: {% for f in p.forks %}<a href="/{{ f }}">{{ f }}</a>{% if not loop.last %}, {% endif %}{% endfor %}</p>{% endif %}
<pre>agentstack hub pull {{ p.owner }}/{{ p.name }}{% if version %}@{{ version }}{% endif %}</pre>
{% if readme %}<div class="readme">{{ readme|safe }}</div>{% endif %}
<h2>Leaderboard{% if version %} <span class="muted">({{ version }})</span>{% endif %}</h2>
<table id="leaderboard"><tr><th>#</th><th>model</th><th>score</th><th>95% CI</th><th>episodes</th><th>harness</th><th>by</th></tr>
{% for e in board %}<tr><td>{{ e.rank }}</td><td>{{ e.model }}</td><td>{{ "%.3f"|format(e.score) }}</td>
<td>[{{ "%.3f"|format(e.ci95[0]) }}, {{ "%.3f"|format(e.ci95[1]) }}]</td><td>{{ e.episodes }}</td><td><code>{{ e.harness }}</code></td><td>{{ e.user }}</td></tr>
{% else %}<tr><td colspan="7" class="muted">No results posted yet (<code>agentstack eval … --post</code>).</td></tr>{% endfor %}
</table>
<h2>Versions</h2>
<table id="versions"><tr><th>version</th><th>tags</th><th>validation</th><th>size</th><th>files</th><th>pushed by</th><th>sha256</th></tr>
{% for v in p.versions %}<tr><td><a href="?version={{ v.version }}">{{ v.version }}</a></td><td>{{ v.tags|join(", ") }}</td>
<td class="{{ v.validation.status }}">{{ v.validation.status }}{% for c in v.validation.checks %}<br><span class="muted">{{ c.name }}: {{ c.status }} — {{ c.message }}</span>{% endfor %}</td>
<td>{{ v.size }}</td><td>{{ v.files }}</td><td>{{ v.pushed_by }}</td><td><code>{{ v.sha256[:12] }}</code></td></tr>{% endfor %}
</table>
{% endblock %}"#;

const ERROR: &str = r#"{% extends "base.html" %}{% block body %}<h1>{{ status }}</h1><p>{{ message }}</p>{% endblock %}"#;

static TEMPLATES: LazyLock<Environment<'static>> = LazyLock::new(|| {
    let mut env = Environment::new();
    env.add_template("base.html", BASE).expect("base template");
    env.add_template("index.html", INDEX)
        .expect("index template");
    env.add_template("package.html", PACKAGE)
        .expect("package template");
    env.add_template("error.html", ERROR)
        .expect("error template");
    env
});

fn render(name: &str, ctx: minijinja::Value) -> Response {
    match TEMPLATES.get_template(name).and_then(|t| t.render(ctx)) {
        Ok(html) => Html(html).into_response(),
        Err(e) => {
            tracing::error!(error = %e, template = name, "rendering a page failed");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "rendering the page failed",
            )
                .into_response()
        }
    }
}

fn error_page(e: RegistryError) -> Response {
    let (status, _) = e.status();
    let message = if status.is_server_error() {
        tracing::error!(error = %e, "page");
        "Something went wrong on the hub.".to_owned()
    } else {
        e.to_string()
    };
    let mut page = render(
        "error.html",
        context! { status => status.to_string(), message },
    );
    *page.status_mut() = status;
    page
}

/// What the pages may load: no script, no frames, no plugins; the inline style of
/// `BASE`, images of the hub and of https sites (README images), and the search
/// form submitting to the hub.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' https:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// Adds the Content-Security-Policy, `X-Content-Type-Options: nosniff` and a
/// referrer policy to a response (every response of the hub: pages, errors, API).
pub async fn security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    response
}

/// Whether a README link may lead to `url` (as pulldown-cmark parsed it: entities
/// and escapes decoded): http, https and mailto, or an address without a scheme
/// (relative, `#anchor`, `//host/...`). Browsers drop tabs and newlines anywhere in
/// a URL and spaces and control characters around it, so this does first; a `:`
/// before any `/`, `?` or `#` makes what precedes it a scheme, whatever its
/// characters.
fn allowed_url(url: &str, schemes: &[&str]) -> bool {
    let cleaned: String = url
        .chars()
        .filter(|c| !matches!(c, '\t' | '\n' | '\r'))
        .collect();
    let cleaned = cleaned.trim_matches(|c: char| c <= ' ' || c.is_control());
    let end = cleaned.find(['/', '?', '#']).unwrap_or(cleaned.len());
    match cleaned[..end].split_once(':') {
        None => true,
        Some((scheme, _)) => schemes.iter().any(|s| scheme.eq_ignore_ascii_case(s)),
    }
}

/// Schemes a README link may use.
const LINK_SCHEMES: &[&str] = &["http", "https", "mailto"];
/// Schemes a README image may load from.
const IMAGE_SCHEMES: &[&str] = &["http", "https"];

/// Markdown to HTML; raw HTML in the source is shown as text, and a link or image
/// to any other place than `allowed_url` allows is rendered as its text alone.
pub fn markdown(text: &str) -> String {
    use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};
    // Whether each open link (image) was kept, so its end goes with it.
    let (mut links, mut images) = (Vec::new(), Vec::new());
    let parser = Parser::new_ext(text, Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH)
        .filter_map(|event| match event {
            Event::Html(raw) | Event::InlineHtml(raw) => Some(Event::Text(raw)),
            Event::Start(Tag::Link { ref dest_url, .. }) => {
                let keep = allowed_url(dest_url, LINK_SCHEMES);
                links.push(keep);
                keep.then_some(event)
            }
            Event::End(TagEnd::Link) => links.pop().unwrap_or(true).then_some(event),
            Event::Start(Tag::Image { ref dest_url, .. }) => {
                let keep = allowed_url(dest_url, IMAGE_SCHEMES);
                images.push(keep);
                keep.then_some(event)
            }
            Event::End(TagEnd::Image) => images.pop().unwrap_or(true).then_some(event),
            other => Some(other),
        });
    let mut html = String::new();
    pulldown_cmark::html::push_html(&mut html, parser);
    html
}

pub(crate) fn routes() -> Router<Arc<Registry>> {
    Router::new()
        .route("/", get(index))
        .route("/{owner}/{name}", get(package))
}

#[derive(Deserialize)]
struct IndexParams {
    #[serde(default)]
    q: String,
    #[serde(default)]
    sort: SearchSort,
}

async fn index(State(r): State<Arc<Registry>>, Query(params): Query<IndexParams>) -> Response {
    let query = SearchQuery {
        q: params.q.clone(),
        sort: params.sort,
        limit: Some(100),
        offset: None,
    };
    match r.search(None, &query).await {
        Ok(results) => render(
            "index.html",
            context! { q => params.q, sort => serde_json::to_value(params.sort).ok(), results },
        ),
        Err(e) => error_page(e),
    }
}

#[derive(Deserialize)]
struct PackageParams {
    version: Option<String>,
}

async fn package(
    State(r): State<Arc<Registry>>,
    Path((owner, name)): Path<(String, String)>,
    Query(params): Query<PackageParams>,
) -> Response {
    // The pages are public: they show what a request without a token sees.
    let info = match r.info(None, &owner, &name).await {
        Ok(info) => info,
        Err(e) => return error_page(e),
    };
    let reference = params
        .version
        .clone()
        .or_else(|| info.dist_tags.get(crate::api::LATEST).cloned());
    let board = match &reference {
        Some(v) => match r.leaderboard(None, &owner, &name, v).await {
            Ok(b) => b.entries,
            Err(e) => return error_page(e),
        },
        None => Vec::new(),
    };
    let readme = markdown(&info.readme);
    render(
        "package.html",
        context! { p => info, version => reference, board, readme },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readme_html_is_shown_as_text() {
        let html = markdown("# Title\n\n<script>alert(1)</script>\n\nhi <img src=x onerror=y>");
        assert!(html.contains("<h1>Title</h1>"));
        assert!(!html.contains("<script>") && !html.contains("<img"));
        assert!(html.contains("&lt;script&gt;"));
    }

    #[test]
    fn readme_links_to_script_are_rendered_as_text() {
        let hostile = [
            "[a](javascript:alert(1))",
            "[a](JaVaScRiPt:alert(1))",
            "[a](&#106;avascript:alert(1))",
            "[a](&#x6A;avascript&colon;alert(1))",
            "[a](java&#x09;script:alert(1))",
            "[a](<\u{1}javascript:alert(1)>)",
            "[a](<  javascript:alert(1)>)",
            "[a](vbscript:msgbox)",
            "[a](data:text/html;base64,PHNjcmlwdD4=)",
            "[a][1]\n\n[1]: javascript:alert(1)",
            "[a][1]\n\n[1]: <java\nscript:alert(1)>",
            "<javascript:alert(1)>",
            "![a](javascript:alert(1))",
            "![a](data:image/svg+xml;base64,PHN2Zz4=)",
            "[![a](https://x.test/i.png)](javascript:alert(1))",
        ];
        for source in hostile {
            let html = markdown(source);
            let lower = html.to_lowercase();
            assert!(
                !lower.contains("href=") || lower.contains("href=\"https://"),
                "{source:?} kept a link: {html}"
            );
            for bad in ["javascript", "vbscript", "data:"] {
                assert!(
                    !lower.contains(&format!("=\"{bad}")),
                    "{source:?} kept {bad}: {html}"
                );
            }
        }
        // The text stays; safe links and images stay.
        assert!(markdown("[click](javascript:x)").contains("click"));
        let html = markdown(
            "[a](https://x.test/) [b](docs/x.md) [c](#usage) [d](mailto:a@x.test) ![e](img/e.png)",
        );
        for kept in [
            "href=\"https://x.test/\"",
            "href=\"docs/x.md\"",
            "href=\"#usage\"",
            "href=\"mailto:a@x.test\"",
            "src=\"img/e.png\"",
        ] {
            assert!(html.contains(kept), "{kept}: {html}");
        }
    }
}
